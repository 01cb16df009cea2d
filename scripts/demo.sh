#!/usr/bin/env bash
# `make demo`: fastshare end to end on simulated GPUs, no GPU, no root, no cluster needed.
#
# A controller and two node agents on loopback (mTLS with certificates made here), two
# simulated machines (2x A100-40GB | 1x H100-80GB + 1x L4), `fastshare run` for every kind of
# request (one is rejected with its reason), `fastshare status`, then everything is released
# and stopped. Nothing is left running (trap), everything lives in one temporary directory.
set -euo pipefail
export COLUMNS="${COLUMNS:-130}"
work="$(mktemp -d "${TMPDIR:-/tmp}/fastshare-demo.XXXXXX")"
pids=()

stop_all() {  # newest first: workloads release before the agents and the controller stop
  local i
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill -TERM "${pids[i]}" 2>/dev/null || true
    wait "${pids[i]}" 2>/dev/null || true
  done
  pids=()
}

cleanup() {
  stop_all
  # The agents stop their MPS daemons on release; this only matters if the demo failed midway.
  for mps in "$work"/node-*/run/mps; do
    [ -d "$mps" ] || continue
    for pipe in "$mps"/*/pipe; do
      [ -d "$pipe" ] && echo quit | CUDA_MPS_PIPE_DIRECTORY="$pipe" fastshare-mps-standin >/dev/null 2>&1 || true
    done
  done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_until() {  # wait_until SECONDS WHAT COMMAND...
  local deadline=$((SECONDS + $1)) what="$2"; shift 2
  until "$@" >/dev/null 2>&1; do
    if [ "$SECONDS" -ge "$deadline" ]; then echo "timed out waiting for $what" >&2; exit 1; fi
    sleep 0.3
  done
}
active_count() {
  fastshare status --json | python3 -c \
    'import json,sys; print(sum(a["state"] == "ALLOCATION_STATE_ACTIVE" for a in json.load(sys.stdin)["allocations"]))'
}
nodes_up() { [ "$(fastshare status --json | python3 -c \
  'import json,sys; print(sum(n["available"] for n in json.load(sys.stdin)["nodes"]))')" = 2 ]; }
has_active() { [ "$(active_count)" = "$1" ]; }

controller_port="$(free_port)"
export FASTSHARE_CONTROLLER="127.0.0.1:$controller_port" FASTSHARE_TLS_DIR="$work/pki"

step "certificates: a cluster CA, the controller, a client and two nodes (mTLS everywhere)"
fastshare certs init "$work/ca" >/dev/null
for role_name in controller:controller client:client node:node-a node:node-b; do
  fastshare certs issue --ca "$work/ca" --role "${role_name%%:*}" --name "${role_name#*:}" --san 127.0.0.1 \
    --out "$work/pki" >/dev/null
done
ls "$work/pki"

step "two simulated machines"
fastshare sim-machine create "$work/node-a.json" --gpus A100-SXM4-40GB,A100-SXM4-40GB | sed -n 1p
fastshare sim-machine create "$work/node-b.json" --gpus H100-SXM5-80GB,L4 | sed -n 1p

step "controller (SQLite state, single instance) and two node agents that register with it"
fastshare controller serve --state-dir "$work/controller" --tls-dir "$work/pki" \
  --listen "$FASTSHARE_CONTROLLER" --heartbeat-interval 1 --log-level warning 2>"$work/controller.log" &
pids+=($!)
for node in node-a node-b; do
  mkdir -p "$work/$node"
  cat >"$work/$node.yaml" <<EOF
node_name: $node
listen: 127.0.0.1:$(free_port)
unix_socket: $work/$node/node.sock
state_dir: $work/$node/state
run_dir: $work/$node/run
device_backend: sim
sim_state: $work/$node.json
mps_control_binary: $(command -v fastshare-mps-standin)
metrics_listen: ""
controller_address: $FASTSHARE_CONTROLLER
share_ports: $([ "$node" = node-a ] && echo 41000-41099 || echo 41100-41199)
tls: {cert: $work/pki/$node.crt, key: $work/pki/$node.key, ca: $work/pki/ca.crt}
EOF
  fastshare node serve --config "$work/$node.yaml" --log-level WARNING 2>"$work/$node.log" &
  pids+=($!)
done
wait_until 60 "two registered nodes" nodes_up
echo "controller on $FASTSHARE_CONTROLLER; node-a and node-b registered"

step "fastshare run: the workload sees its share in its environment"
fastshare run --sm 30 --mem 8GiB --quota 0.3:0.6 --model 'A100*' -- \
  sh -c 'env | grep -E "^(CUDA_|NVIDIA_VISIBLE)" | sort'

step "submit a mix of all four kinds (each holds its allocation while its command runs)"
runs=()
submit() {  # one at a time, so that the placements (and this demo) are deterministic
  fastshare run "$@" -- sleep 300 &
  runs+=($!); pids+=($!)
  wait_until 60 "allocation ${#runs[@]} to be active" has_active "${#runs[@]}"
}
submit --kind whole --gpus 1 --model 'A100*'
submit --kind fastpod --sm 30 --mem 8GiB --quota 0.3:0.6 --model 'A100*'
submit --kind fastpod --sm 50 --mem 12GiB --model 'A100*'
submit --kind mps --mem 6GiB --model L4
submit --kind exclusive --mig-profile 3g.40gb --model 'H100*'

step "one request that cannot fit is rejected with the reason"
fastshare run --kind whole --gpus 2 -- true || true
step "and an invalid one names the field and what it must be (a time-quota limit below its request)"
fastshare run --sm 30 --mem 1GiB --quota 0.9:0.3 -- true || true

step "fastshare status"
fastshare status

step "release everything (SIGTERM to each fastshare run is forwarded to its command)"
for pid in "${runs[@]}"; do kill -TERM "$pid"; done
for pid in "${runs[@]}"; do wait "$pid" 2>/dev/null || true; done
wait_until 30 "all released" has_active 0
fastshare status --all | sed -n '/Allocations/,$p'

step "stop the agents and the controller"
stop_all
echo "done in ${SECONDS}s; nothing left running"
