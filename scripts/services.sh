#!/usr/bin/env bash
# Build, start and stop the real pipeline programs used by tests/pipeline and by hand:
# the otelcol-straggler collector, Jaeger v2, Prometheus/promtool (and docker-compose, to validate
# docker-compose.yml); and, for the Helm chart's tests (tests/deploy), Helm and the manifest checker.
#
#   scripts/services.sh build   build or fetch what is missing; cached, so a second run takes seconds.
#                               Helm and the checker build in the background (a cold Helm build takes
#                               minutes): the chart tests wait for them with `await-helm`
#   scripts/services.sh build-helm   build Helm and the checker in the foreground
#   scripts/services.sh await-helm   wait for a background Helm build; fails if it failed
#   scripts/services.sh start   start Jaeger, Prometheus and the gateway collector on 127.0.0.1,
#                               free ports, recorded in .services/env (logs in .services/*.log)
#   scripts/services.sh stop    stop whatever `start` started (safe to run any time)
#   scripts/services.sh env     print the env file of the running stack
#
# Cache: ${OTEL_STRAGGLER_CACHE:-$HOME/.cache/otel-straggler}/bin holds the binaries; each build
# lives in a folder keyed by a hash of its inputs (manifest or go.mod/go.sum, builder and Go
# versions), so a changed manifest rebuilds and an unchanged one does not.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${OTEL_STRAGGLER_CACHE:-$HOME/.cache/otel-straggler}"
BIN="$CACHE/bin"
SERVICES_DIR="${OTEL_STRAGGLER_SERVICES_DIR:-$REPO/.services}"
# The OpenTelemetry Collector Builder release; keep it equal to dist.version in builder-config.yaml.
OCB_VERSION="v0.161.0"
# Upper bound for one Go build (cold builds take minutes on two cores).
BUILD_TIMEOUT_S="${OTEL_STRAGGLER_BUILD_TIMEOUT_S:-2400}"

log() { printf '[services] %s\n' "$*" >&2; }

find_go() {
  if command -v go >/dev/null 2>&1; then command -v go; return; fi
  if [ -x /usr/local/go/bin/go ]; then echo /usr/local/go/bin/go; return; fi
  log "Go is needed to build the collector and Jaeger (go 1.26 or newer)"; exit 1
}

hash_of() {  # hash of the given files' contents plus extra words
  local files=("$@")
  { cat "${files[@]}"; echo "$EXTRA_KEY"; } | sha256sum | cut -c1-16
}

collector_out() {  # the cache folder of the collector build for this manifest and Go
  local go="$1"
  EXTRA_KEY="$OCB_VERSION $("$go" env GOVERSION)"
  echo "$CACHE/build/otelcol-$(hash_of "$REPO/collector-config/builder-config.yaml")"
}

jaeger_out() {
  local go="$1" module="$REPO/collector-config/jaeger"
  EXTRA_KEY="$("$go" env GOVERSION)"
  echo "$CACHE/build/jaeger-$(hash_of "$module/go.mod" "$module/go.sum")"
}

build_collector() {
  local go; go="$(find_go)"
  local manifest="$REPO/collector-config/builder-config.yaml"
  local out; out="$(collector_out "$go")"
  if [ -x "$out/otelcol-straggler" ]; then
    log "collector: cached ($out)"
  else
    local builder="$CACHE/tools/builder-$OCB_VERSION/builder"
    if [ ! -x "$builder" ]; then
      log "collector: installing builder $OCB_VERSION"
      GOBIN="$(dirname "$builder")" timeout "$BUILD_TIMEOUT_S" "$go" install "go.opentelemetry.io/collector/cmd/builder@$OCB_VERSION"
    fi
    log "collector: building (cold builds take several minutes)"
    local work="$out.partial"
    rm -rf "$work"; mkdir -p "$work"
    # Same manifest, output redirected into the cache.
    sed "s#^\([[:space:]]*output_path:\).*#\1 $work#" "$manifest" > "$work/manifest.yaml"
    local start=$SECONDS
    PATH="$(dirname "$go"):$PATH" timeout "$BUILD_TIMEOUT_S" "$builder" --config "$work/manifest.yaml" > "$work/build.log" 2>&1 \
      || { tail -n 30 "$work/build.log" >&2; log "collector: build failed (log: $work/build.log)"; exit 1; }
    rm -rf "$out"; mv "$work" "$out"
    log "collector: built in $((SECONDS - start))s"
  fi
  mkdir -p "$BIN"; ln -sfn "$out/otelcol-straggler" "$BIN/otelcol-straggler"
}

build_jaeger() {
  local go; go="$(find_go)"
  local module="$REPO/collector-config/jaeger"
  local out; out="$(jaeger_out "$go")"
  if [ -x "$out/jaeger" ]; then
    log "jaeger: cached ($out)"
  else
    log "jaeger: building (cold builds take several minutes)"
    mkdir -p "$out"
    local start=$SECONDS
    (cd "$module" && timeout "$BUILD_TIMEOUT_S" "$go" build -o "$out/jaeger.partial" github.com/jaegertracing/jaeger/cmd/jaeger) \
      || { log "jaeger: build failed"; exit 1; }
    mv "$out/jaeger.partial" "$out/jaeger"
    log "jaeger: built in $((SECONDS - start))s"
  fi
  mkdir -p "$BIN"; ln -sfn "$out/jaeger" "$BIN/jaeger"
}

# Helm v4 (helm.sh/helm/v4/cmd/helm, the version pinned in deploy/helm/tools/go.mod and go.sum)
# and the manifest checker (deploy/helm/check), for tests/deploy.
# `helm version` says what go.mod pins (a plain go build leaves Helm's "v4.3" without the patch)
helm_ldflags() {
  echo "-X helm.sh/helm/v4/internal/version.version=$(awk '$1 == "helm.sh/helm/v4" {print $2}' "$REPO/deploy/helm/tools/go.mod")"
}

helm_out() {
  local go="$1" module="$REPO/deploy/helm/tools"
  EXTRA_KEY="$("$go" env GOVERSION) $(helm_ldflags)"
  echo "$CACHE/build/helm-$(hash_of "$module/go.mod" "$module/go.sum")"
}

checker_out() {
  local go="$1" module="$REPO/deploy/helm/check"
  EXTRA_KEY="$("$go" env GOVERSION)"
  echo "$CACHE/build/k8s-check-$(hash_of "$module/go.mod" "$module/go.sum" "$module/main.go")"
}

helm_built() {
  local go="$1"
  [ -x "$(helm_out "$go")/helm" ] && [ -x "$(checker_out "$go")/k8s-check" ]
}

go_build_into() {  # go_build_into NAME MODULE_DIR OUT_DIR PACKAGE [LDFLAGS]: build into OUT_DIR/NAME, timed
  local name="$1" module="$2" out="$3" package="$4" ldflags="${5:-}" go; go="$(find_go)"
  if [ -x "$out/$name" ]; then log "$name: cached ($out)"; else
    log "$name: building"
    mkdir -p "$out"
    local start=$SECONDS
    (cd "$module" && timeout "$BUILD_TIMEOUT_S" "$go" build -ldflags="$ldflags" -o "$out/$name.partial" "$package") \
      || { log "$name: build failed"; return 1; }
    mv "$out/$name.partial" "$out/$name"
    log "$name: built in $((SECONDS - start))s"
  fi
  mkdir -p "$BIN"; ln -sfn "$out/$name" "$BIN/$name"
}

build_helm() {  # Helm first: the checker then reuses its compiled k8s.io packages
  local go; go="$(find_go)"
  go_build_into helm "$REPO/deploy/helm/tools" "$(helm_out "$go")" helm.sh/helm/v4/cmd/helm "$(helm_ldflags)"
  go_build_into k8s-check "$REPO/deploy/helm/check" "$(checker_out "$go")" .
}

# The background build: its log and, while it runs, its pid, beside the cached builds.
HELM_BG_LOG="$CACHE/build/helm-background.log"
HELM_BG_PID="$CACHE/build/helm-background.pid"

helm_background_running() {  # the pid file's process, if it is still our build (pids get reused)
  local pid; pid="$(cat "$HELM_BG_PID" 2>/dev/null)" || return 1
  [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q "services.sh build-helm"
}

start_helm_background() {
  local go; go="$(find_go)"
  if helm_built "$go"; then
    mkdir -p "$BIN"
    ln -sfn "$(helm_out "$go")/helm" "$BIN/helm"; ln -sfn "$(checker_out "$go")/k8s-check" "$BIN/k8s-check"
    log "helm, k8s-check: cached"; return
  fi
  if helm_background_running; then
    log "helm, k8s-check: a background build is already running (log: $HELM_BG_LOG)"; return
  fi
  mkdir -p "$CACHE/build"
  # One core at low priority, so the test suite that starts next keeps the other; setsid, so the
  # build outlives this script and make's step.
  log "helm, k8s-check: building in the background (cold: minutes; log: $HELM_BG_LOG)"
  local goflags; goflags="$("$go" env GOFLAGS)"  # an env GOFLAGS replaces go env's: keep its flags
  GOMAXPROCS=1 GOFLAGS="${goflags:+$goflags }-p=1" setsid nice -n 19 "$0" build-helm > "$HELM_BG_LOG" 2>&1 < /dev/null &
  echo $! > "$HELM_BG_PID"
}

await_helm() {
  local go; go="$(find_go)" waited=0
  while ! helm_built "$go"; do
    if ! helm_background_running; then
      # no build running: the last one failed, or none was started
      helm_built "$go" && break
      [ -f "$HELM_BG_LOG" ] && tail -n 20 "$HELM_BG_LOG" >&2
      log "helm, k8s-check: not built and no build running (scripts/services.sh build-helm)"; exit 1
    fi
    [ "$waited" -eq 0 ] && log "helm, k8s-check: waiting for the background build (log: $HELM_BG_LOG)"
    [ "$waited" -ge "$BUILD_TIMEOUT_S" ] && { log "helm, k8s-check: still building after ${waited}s"; exit 1; }
    sleep 2; waited=$((waited + 2))
  done
  [ "$waited" -gt 0 ] && log "helm, k8s-check: waited ${waited}s"
  mkdir -p "$BIN"
  ln -sfn "$(helm_out "$go")/helm" "$BIN/helm"; ln -sfn "$(checker_out "$go")/k8s-check" "$BIN/k8s-check"
}

install_debian_packages() {
  local wanted=()
  command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || wanted+=(prometheus)
  command -v docker-compose >/dev/null 2>&1 || wanted+=(docker-compose)
  command -v openssl >/dev/null 2>&1 || wanted+=(openssl)
  if [ "${#wanted[@]}" -eq 0 ]; then log "debian packages: present"; return; fi
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    log "missing ${wanted[*]}: install them (Debian: apt-get install ${wanted[*]})"; exit 1
  fi
  log "debian packages: installing ${wanted[*]}"
  # The prometheus package would start its own daemon on :9090; a policy-rc.d that says 101
  # ("action forbidden") stops the package scripts from starting any service.
  local policy=/usr/sbin/policy-rc.d made_policy=""
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"; made_policy=1
  fi
  local rc=0
  { timeout 600 env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${wanted[@]}" \
      || { timeout 300 apt-get update -qq && timeout 600 env DEBIAN_FRONTEND=noninteractive \
             apt-get install -y -qq --no-install-recommends "${wanted[@]}"; }; } >/dev/null || rc=$?
  [ -n "$made_policy" ] && rm -f "$policy"
  [ "$rc" -eq 0 ] || { log "apt-get install ${wanted[*]} failed"; exit 1; }
}

python_for_helpers() {  # the helper is standard-library only: any Python 3.9+ will do
  command -v python3 || { log "python3 is needed"; exit 1; }
}

case "${1:-}" in
  build)
    start=$SECONDS
    go="$(find_go)"
    if [ ! -x "$(collector_out "$go")/otelcol-straggler" ] || [ ! -x "$(jaeger_out "$go")/jaeger" ]; then
      log "next: building the OTel Collector and Jaeger from source with Go, several minutes" \
          "from nothing (about 6 on 2 cores); later runs reuse the build"
    fi
    install_debian_packages
    build_collector
    build_jaeger
    start_helm_background
    log "build done in $((SECONDS - start))s; binaries in $BIN"
    ;;
  build-helm)
    start=$SECONDS
    build_helm
    log "helm build done in $((SECONDS - start))s"
    ;;
  await-helm)
    await_helm
    ;;
  start)
    "$(python_for_helpers)" "$REPO/otel_straggler/testing/services.py" start --dir "$SERVICES_DIR"
    ;;
  stop)
    "$(python_for_helpers)" "$REPO/otel_straggler/testing/services.py" stop --dir "$SERVICES_DIR"
    ;;
  env)
    cat "$SERVICES_DIR/env"
    ;;
  *)
    echo "usage: $0 build|build-helm|await-helm|start|stop|env" >&2
    exit 2
    ;;
esac
