# The otelcol-straggler collector image: builder-config.yaml built with the OpenTelemetry Collector
# Builder, as scripts/services.sh builds it for the tests. The Helm chart's collectorImage.
#
#   docker build -f collector-config/collector.Dockerfile -t otelcol-straggler:0.161.0 collector-config
#
# Keep the builder version equal to OCB_VERSION in scripts/services.sh and dist.version.
FROM golang:1.26-bookworm AS build
RUN go install go.opentelemetry.io/collector/cmd/builder@v0.161.0
WORKDIR /src
COPY builder-config.yaml .
RUN builder --config builder-config.yaml

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --no-create-home --uid 10001 otelcol
COPY --from=build /src/build/otelcol-straggler/otelcol-straggler /otelcol-straggler
USER 10001
EXPOSE 4317 4318 8888 8889 13133
ENTRYPOINT ["/otelcol-straggler"]
CMD ["--config=/etc/otelcol/gateway.yaml"]
