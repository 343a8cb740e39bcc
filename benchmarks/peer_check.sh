# Sourced by the peer scripts (benchmarks/peer_*.sh): their `check` subcommand.
#
# check_served NAME DIR PORT: start "$0 serve DIR DTYPE PORT" for float32 and then bfloat16,
# wait for /health, ask for one greedy 8-token completion of a short text prompt, print it
# with the time the server took to come up, and stop the server (SIGINT, as compare.py does).
# The server's output goes to /tmp/peer-NAME-DTYPE.log.
check_served() {
  local name=$1 dir=$2 port=$3 dtype pid started body
  for dtype in float32 bfloat16; do
    "$0" serve "$dir" "$dtype" "$port" >"/tmp/peer-$name-$dtype.log" 2>&1 &
    pid=$!
    started=$(date +%s)
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
      if ! kill -0 "$pid" 2>/dev/null || [ $(($(date +%s) - started)) -gt 600 ]; then
        echo "the peer did not come up in $dtype; see /tmp/peer-$name-$dtype.log" >&2
        kill "$pid" 2>/dev/null || true
        return 1
      fi
      sleep 2
    done
    body=$(curl -sf "http://127.0.0.1:$port/v1/completions" -H 'content-type: application/json' \
      -d "{\"model\": \"$(basename "$dir")\", \"prompt\": \"the engine serves\", \"max_tokens\": 8, \"temperature\": 0}")
    echo "$dtype: up in $(($(date +%s) - started)) s; completion: $body"
    kill -INT "$pid"
    wait "$pid" || true
  done
}
