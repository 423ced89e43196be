"""The video stage: diffusion engines, the worker's job runner, MP4 encoding and storage, and the
frontend's /v1/videos API (HTTP parsing and job ids). No gRPC here: tandem/runtime/video_client.py
and services/video/ translate."""
