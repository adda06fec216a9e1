"""Synthetic span streams and scripted jobs for tests and benchmarks; not part of the stable API.

Torch-free, and imported only by tests/ and benchmarks/, never by the rest of the package (so a
training job or the detector never loads it).

| module | what it gives |
|---|---|
| `synthetic` | `SyntheticJob`: seeded stage observations of a data-parallel cohort, with slowdowns |
| `host_noise` | `HostNoise`, `BusyHost`: the drifting, heavy-tailed noise of busy hosts for `SyntheticJob` |
| `scripted_job` | `ScriptedJob`: a small job scripted second by second against the real engine (hangs, restarts) |
| `otlp_spans` | the rank side's spans as SDK ReadableSpans, OTLP requests, collector JSON lines; a service in a thread|
| `services` | the real collector, Jaeger, Prometheus of a source checkout (`scripts/services.sh build`), free ports |
"""
