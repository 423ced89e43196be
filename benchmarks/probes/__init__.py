"""Diagnostics: one-off probes of where time goes, kept for re-running a finding (see
benchmarks/README.md, "Probes"). Nothing a user needs to run to know where Tandem stands."""
