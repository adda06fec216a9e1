# otel-straggler: one image for the detector (`otel-straggler detect`) and the demo trainer
# (`otel-straggler demo`). Used by docker-compose.yml; build on its own with
#   docker build -t otel-straggler .
#
# torch comes from the default package index, which ships CUDA wheels; to keep the image small
# for CPU-only use, pass an index with CPU builds: --build-arg PIP_EXTRA_INDEX_URL=<index>.
FROM python:3.12-slim

ARG PIP_EXTRA_INDEX_URL=
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL}

WORKDIR /src
COPY . /src
# gcc only for the C fast paths (otel_straggler/*/_otlp_*.c: the detector's and the demo ranks'), removed after
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && pip install "/src[torch]" \
    && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 straggler \
    && mkdir -p /var/lib/otel-straggler/evidence \
    && chown -R straggler /var/lib/otel-straggler

USER straggler
WORKDIR /var/lib/otel-straggler
ENTRYPOINT ["otel-straggler"]
CMD ["--help"]
