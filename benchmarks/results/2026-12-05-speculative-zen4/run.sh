#!/usr/bin/env bash
# Speculative decoding figures: plain vs speculative, interleaved A B A B, c=1 and c=4.
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/specbench}
PORT=8011
serve_bench() { # name model repeats [spec-json]
  local name=$1 model=$2 repeats=$3 spec=$4
  if [ -n "$spec" ]; then
    .tox/compare/bin/tandem serve "$model" --port $PORT --speculative-config "$spec" > $OUT/$name.server.log 2>&1 &
  else
    .tox/compare/bin/tandem serve "$model" --port $PORT > $OUT/$name.server.log 2>&1 &
  fi
  local pid=$!
  until curl -sf http://127.0.0.1:$PORT/health > /dev/null; do sleep 1; done
  for c in 1 4; do
    .tox/compare/bin/tandem bench serve --base-url http://127.0.0.1:$PORT --num-prompts 8 \
      --input-len 256 --output-len 96 --max-concurrency $c --ignore-eos --prompt-repeats $repeats \
      --num-warmups 1 --seed 1 --result-json $OUT/$name-c$c.json > $OUT/$name-c$c.txt 2>&1
  done
  curl -s http://127.0.0.1:$PORT/metrics | grep "spec_decode" > $OUT/$name.metrics
  kill $pid; wait $pid 2>/dev/null
}
NGRAM='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
MTP='{"method": "mtp", "num_speculative_tokens": 1}'
for round in 1 2; do
  serve_bench dense-plain-r$round /tmp/ngram-bench 4
  serve_bench dense-ngram-r$round /tmp/ngram-bench 4 "$NGRAM"
  serve_bench hybrid-plain-r$round /tmp/hybrid-mtp 4
  serve_bench hybrid-ngram-r$round /tmp/hybrid-mtp 4 "$NGRAM"
  serve_bench hybrid-mtp-plain-r$round /tmp/hybrid-mtp 1
  serve_bench hybrid-mtp-r$round /tmp/hybrid-mtp 1 "$MTP"
done
echo done > $OUT/done
