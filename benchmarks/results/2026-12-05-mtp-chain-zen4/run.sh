#!/usr/bin/env bash
# Plain vs MTP with 1 and 3 drafts a step on the bench-size story hybrid (inflate_model.py),
# interleaved, two rounds; bfloat16.
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/mtpbench}
mkdir -p $OUT
PORT=8014
MODEL=${MODEL:-/tmp/story-bench}
TANDEM=${TANDEM:-.tox/tests/bin/tandem}
serve_bench() { # name [spec-json]
  local name=$1 spec=$2
  if [ -n "$spec" ]; then
    $TANDEM serve "$MODEL" --port $PORT --dtype bfloat16 --speculative-config "$spec" > $OUT/$name.server.log 2>&1 &
  else
    $TANDEM serve "$MODEL" --port $PORT --dtype bfloat16 > $OUT/$name.server.log 2>&1 &
  fi
  local pid=$!
  until curl -sf http://127.0.0.1:$PORT/health > /dev/null; do sleep 1; done
  for c in 1 4; do
    $TANDEM bench serve --base-url http://127.0.0.1:$PORT --num-prompts 8 \
      --input-len 256 --output-len 96 --max-concurrency $c --ignore-eos \
      --num-warmups 1 --seed 1 --result-json $OUT/$name-c$c.json > $OUT/$name-c$c.txt 2>&1
  done
  curl -s http://127.0.0.1:$PORT/metrics | grep "spec_decode" > $OUT/$name.metrics
  kill $pid; wait $pid 2>/dev/null
}
MTP1='{"method": "mtp", "num_speculative_tokens": 1}'
MTP3='{"method": "mtp", "num_speculative_tokens": 3}'
for round in 1 2; do
  serve_bench plain-r$round
  serve_bench mtp1-r$round "$MTP1"
  serve_bench mtp3-r$round "$MTP3"
done
echo done > $OUT/done
