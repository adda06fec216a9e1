#!/usr/bin/env bash
# Regenerates the README's pictures from a real run of the demo, so they show what the tool does
# today: docs/images/rank_timeline.png and heatmap.png are the report's own figures, and
# docs/images/demo-run.txt records the run (command, date, machine, code version, its summary and
# its first straggler verdict), from which the README quotes.
#   scripts/readme_images.sh [VENV]       about 25 s on 2 idle cores, after `make venv`
# Run it on a quiet machine: other work on the cores can get a healthy rank flagged (docs/demo.md).
set -euo pipefail
venv=${1:-${OTEL_STRAGGLER_VENV:-$HOME/.cache/otel-straggler/venv}}
repo=$(cd "$(dirname "$0")/.." && pwd)
images="$repo/docs/images"
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT

command=(otel-straggler demo)
(cd "$repo" && PYTHONPATH="$repo" "$venv/bin/python" -m otel_straggler "${command[@]:1}" --out "$run/demo") > "$run/stdout"
mkdir -p "$images"
cp "$run/demo/rank_timeline.png" "$run/demo/heatmap.png" "$images/"
{
  echo "command: ${command[*]}"
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)," \
       "$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1), load average $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "code: $(git -C "$repo" rev-parse --short HEAD)$(git -C "$repo" diff --quiet HEAD -- otel_straggler || echo ' with uncommitted changes')"
  echo
  echo "summary:"
  awk '/^$/ {paragraph = ""; next} /^report:/ {printf "%s", paragraph; exit} {paragraph = paragraph $0 "\n"}' "$run/stdout"
  echo
  echo "first straggler verdict (evidence/verdicts.jsonl):"
  grep -m 1 '"verdict": *"straggler"' "$run/demo/evidence/verdicts.jsonl" || echo "(none)"
} > "$images/demo-run.txt"
cat "$images/demo-run.txt"
ls -l "$images"
