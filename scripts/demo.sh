#!/usr/bin/env bash
# `make demo`: fastshare on simulated GPUs, no GPU and no cluster needed.
# Interim demo of the device layer (the controller demo replaces it): a simulated machine,
# its inventory, a MIG layout planned and applied at explicit placements, the result.
set -euo pipefail
workdir="$(mktemp -d)"
trap 'rm -rf "$workdir"' EXIT
export FASTSHARE_GPU_BACKEND=sim FASTSHARE_SIM_STATE="$workdir/machine.json"
export COLUMNS="${COLUMNS:-140}"

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "a simulated machine: two A100-40GB (MIG on) and one H100"
fastshare sim-machine create "$FASTSHARE_SIM_STATE" --gpus A100-SXM4-40GB,A100-SXM4-40GB,H100-SXM5-80GB \
  --mig-enabled
fastshare gpu list

step "plan 19,19,14,9 on GPU 0 (NVML's own placer fails this order; fastshare searches placements)"
fastshare mig plan --gpu 0 --layout '1g.5gb=2,2g.10gb=1,3g.20gb=1'

step "apply it"
fastshare mig apply --gpu 0 --layout '1g.5gb=2,2g.10gb=1,3g.20gb=1'

step "a process now runs on the 3g.20gb; a new layout must leave it alone"
mig_uuid="$(fastshare gpu list --json | python3 -c \
  'import json,sys; print([i["uuid"] for i in json.load(sys.stdin)["gpus"][0]["mig_instances"] if i["profile_id"] == 9][0])')"
fastshare sim-machine add-process --gpu 0 --mig "$mig_uuid" >/dev/null
fastshare mig plan --gpu 0 --layout '3g.20gb=1,1g.10gb=2'
if ! fastshare mig plan --gpu 0 --layout '7g.40gb=1'; then echo "(refused, as it should be)"; fi

step "the layout applied"
fastshare mig apply --gpu 0 --layout '3g.20gb=1,1g.10gb=2'
fastshare gpu list
