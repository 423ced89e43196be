"""Prometheus metrics of the video stage: the worker's queue and running job (read at scrape
time), seconds per video and denoising steps per second (observed as each job ends), jobs by
outcome; and the frontend's /v1/videos requests."""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tandem.engines.types import EngineStats
from tandem.video.jobs import Job, JobStatus

#: Seconds per video: a tiny model on CPU takes a fraction of a second, Wan 14B at 720p many
#: minutes.
_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 2400)
_STEPS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 25, 50, 100, 250)


class QueueCollector(Collector):
    def __init__(self, worker_id: str, stats: Callable[[], EngineStats]) -> None:
        self.worker_id = worker_id
        self.stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self.stats()  # two ints read off the runner: atomic under the GIL
        for name, help_text, value in (
                ("tandem_video_jobs_queued", "Video jobs waiting for the worker",
                 stats.num_waiting),
                ("tandem_video_jobs_running", "Video jobs being generated", stats.num_running)):
            gauge = GaugeMetricFamily(name, help_text, labels=["worker"])
            gauge.add_metric([self.worker_id], value)
            yield gauge


class VideoWorkerMetrics:
    """The registry a video worker's --metrics-port serves."""

    def __init__(self, worker_id: str, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(QueueCollector(worker_id, stats))
        self.worker_id = worker_id
        self._jobs = Counter("tandem_video_jobs", "Video jobs finished, by outcome",
                             ("worker", "status"), registry=self.registry)
        self._seconds = Histogram("tandem_video_generation_seconds", "Seconds per video "
                                  "(completed jobs: generation start to stored MP4)",
                                  ("worker",), buckets=_SECONDS_BUCKETS, registry=self.registry)
        self._steps = Histogram("tandem_video_denoising_steps_per_second", "Denoising steps per "
                                "second of each completed job (whole generation time)",
                                ("worker",), buckets=_STEPS_BUCKETS, registry=self.registry)

    def observe(self, job: Job) -> None:
        self._jobs.labels(self.worker_id, job.status.value).inc()
        if job.status is JobStatus.COMPLETED and job.generation_seconds > 0:
            self._seconds.labels(self.worker_id).observe(job.generation_seconds)
            self._steps.labels(self.worker_id).observe(job.num_steps / job.generation_seconds)


class VideoFrontendMetrics:
    """/v1/videos requests at the frontend, in the frontend's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("tandem_frontend_video_requests", "Requests to /v1/videos, by "
                                "route and HTTP status", ("route", "status"), registry=registry)
        self.seconds = Histogram("tandem_frontend_video_seconds", "Seconds from a video's "
                                 "creation to its end as the frontend saw it (followed jobs)",
                                 ("status",), buckets=_SECONDS_BUCKETS, registry=registry)
