#!/usr/bin/env bash
# rlink under torchrun: rank 0 is the learner, every other rank an actor (examples/deploy/launch.py).
# Run the same command on every node, from the repository root (or an image holding it):
#
#   export RLINK_TOKEN_FILE=~/.rlink/token            # the same secret on every node (rlink token --file ...)
#   NNODES=2 NPROC_PER_NODE=8 RDZV_ENDPOINT=node0:29500 docs/deploy/torchrun.sh --steps 100000
#
# One node: `docs/deploy/torchrun.sh --steps 10000` (torchrun --standalone). The learner listens on
# RLINK_PORT (8443) of the host of rank 0 (torchrun's MASTER_ADDR); torchrun's own rendezvous uses
# MASTER_PORT / RDZV_ENDPOINT, a different port. TORCHRUN overrides the launcher command.
#
# Many learners: RLINK_LEARNERS=2 makes ranks 0 and 1 learner ranks (Learner(distributed=True); the
# script's own gloo group for its step count meets at MASTER_ADDR:RLINK_GROUP_PORT, default
# RLINK_PORT + 1; rlink's ranks link to rank 0 over its authenticated rank links) and the others
# actors, which still know only rank 0's address; examples/deploy/launch.py. On more than one node
# also export RLINK_RANK_TOKEN_FILE (another secret, the same on every node): learner ranks prove
# with it that they are ranks; launch.py keeps it from the actors.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [ -z "${RLINK_TOKEN:-}" ] && [ -z "${RLINK_TOKEN_FILE:-}" ]; then
    echo "torchrun.sh: set RLINK_TOKEN or RLINK_TOKEN_FILE (the same on every node; make one with: rlink token)" >&2
    exit 2
fi
nnodes=${NNODES:-1}
if [ "$nnodes" = 1 ]; then
    rdzv=(--standalone)
else
    rdzv=(--nnodes "$nnodes" --rdzv-backend c10d --rdzv-id "${RDZV_ID:-rlink}"
          --rdzv-endpoint "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port of one node for torchrun to meet at}")
fi
# shellcheck disable=SC2086  # TORCHRUN may be a command with arguments ("python -m torch.distributed.run")
exec ${TORCHRUN:-torchrun} "${rdzv[@]}" --nproc-per-node "${NPROC_PER_NODE:-4}" \
    "$here/../../examples/deploy/launch.py" "$@"
