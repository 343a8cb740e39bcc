#!/usr/bin/env bash
# The trained head: plain vs MTP vs n-gram on the stories-trained Qwen3.5, interleaved.
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/specbench-story}
mkdir -p $OUT
PORT=8013
MODEL=${MODEL:-/tmp/story-qwen35}
serve_bench() { # name [spec-json]
  local name=$1 spec=$2
  if [ -n "$spec" ]; then
    .tox/compare/bin/tandem serve "$MODEL" --port $PORT --speculative-config "$spec" > $OUT/$name.server.log 2>&1 &
  else
    .tox/compare/bin/tandem serve "$MODEL" --port $PORT > $OUT/$name.server.log 2>&1 &
  fi
  local pid=$!
  until curl -sf http://127.0.0.1:$PORT/health > /dev/null; do sleep 1; done
  for c in 1 4; do
    .tox/compare/bin/tandem bench serve --base-url http://127.0.0.1:$PORT --num-prompts 8 \
      --input-len 256 --output-len 96 --max-concurrency $c --ignore-eos \
      --num-warmups 1 --seed 1 --result-json $OUT/$name-c$c.json > $OUT/$name-c$c.txt 2>&1
  done
  curl -s http://127.0.0.1:$PORT/metrics | grep "spec_decode" > $OUT/$name.metrics
  kill $pid; wait $pid 2>/dev/null
}
MTP='{"method": "mtp", "num_speculative_tokens": 1}'
NGRAM='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
for round in 1 2; do
  serve_bench story-plain-r$round
  serve_bench story-mtp-r$round "$MTP"
  serve_bench story-ngram-r$round "$NGRAM"
done
echo done > $OUT/done
