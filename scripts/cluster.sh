#!/usr/bin/env bash
# An emulated cluster on this machine: N network namespaces as nodes, each
# joined to a bridge by a veth pair whose two directions are rate-limited
# with a token bucket (tc tbf), on a private subnet that exists only inside
# this machine (no route leaves it). OpenMPI launches one rank per node
# through a launch agent that enters the node's namespace (ip netns exec)
# and pins the rank to a core of its own; ranks talk over TCP only.
#
#   scripts/cluster.sh up N [--gbps G] [--mtu M]   # prints mpirun_args=... last
#   scripts/cluster.sh down                        # removes everything
#   mpirun $mpirun_args -np N target/release/examples/train_mpi
#
# Needs root (CAP_NET_ADMIN), iproute2 (ip, tc) and OpenMPI 4. `up` first
# takes down what an earlier `up` left; `down` is safe to run any time,
# also after a failed run (it ends what still runs in the namespaces).
set -euo pipefail

PREFIX=brgc                        # every name this script makes starts with it
BRIDGE=${PREFIX}0
SUBNET=10.77.0                     # /24, private, inside this machine only
STATE=${BRGEMM_CLUSTER_DIR:-/tmp/brgemm-cluster}

die() { echo "cluster.sh: $*" >&2; exit 1; }
usage() { die "usage: cluster.sh up N [--gbps G] [--mtu M] | down"; }

down() {
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^${PREFIX}-n" || true); do
    # What a failed run left in the node ends before the namespace goes:
    # every process whose network namespace it is (`ip netns pids` misses
    # some threads' leaders, so the namespace inode is matched directly).
    local ino
    ino=$(stat -L -c %i "/var/run/netns/$ns" 2>/dev/null || true)
    for _ in $(seq 50); do
      local left=""
      for p in /proc/[0-9]*; do
        [ "$(readlink "$p/ns/net" 2>/dev/null)" = "net:[$ino]" ] && left+=" ${p#/proc/}"
      done
      [ -z "$left" ] && break
      kill -9 $left 2>/dev/null || true
      sleep 0.1
    done
    ip netns del "$ns" 2>/dev/null || true
  done
  for dev in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep "^${PREFIX}" || true); do
    ip link del "$dev" 2>/dev/null || true
  done
  rm -rf "$STATE"
}

up() {
  local n=$1; shift
  local gbps=10 mtu=1500
  while [ $# -gt 0 ]; do
    case $1 in
      --gbps) gbps=${2:?--gbps needs a value}; shift 2 ;;
      --mtu) mtu=${2:?--mtu needs a value}; shift 2 ;;
      *) usage ;;
    esac
  done
  [[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 200 ] || die "N=$n: expected 1..200 nodes"
  [[ $gbps =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--gbps $gbps: expected a rate in Gb/s, e.g. 1 or 2.5"
  [[ $mtu =~ ^[0-9]+$ ]] && [ "$mtu" -ge 576 ] && [ "$mtu" -le 65000 ] || die "--mtu $mtu: expected 576..65000"
  [ "$(id -u)" = 0 ] || die "needs root (network namespaces, veth, tc)"
  command -v mpirun >/dev/null || die "mpirun not found (apt-get install openmpi-bin)"
  down
  mkdir -p "$STATE"
  # Token bucket: a burst of 1 ms of traffic at the rate (at least four
  # frames). tbf releases a burst per watchdog timer wake-up, and in these
  # VMs the wake-ups come every ~150 us, not on time: with a 100 us burst
  # one TCP stream reached 0.69 Gb/s of 1 Gb/s and 0.44 each way both ways
  # at once (what an all-reduce does); with 1 ms, 0.97 and 0.96 (9.6 and
  # 9.1 at 10 Gb/s). Above ~13-16 Gb/s a stream over veth is CPU-bound at
  # any MTU on these cores, so 25 Gb/s links deliver less than their rate:
  # `bench mpi --cluster` measures what the wire gives. The queue holds
  # 10 ms (a longer one only inflates the round trip under load). Rates
  # are printed with %.0f: mawk's %d stops at 2^31-1, which made every
  # link above 2.1 Gb/s a 2.1 Gb/s one (MPI measured 2.06 Gb/s on "10").
  local rate_bps burst
  rate_bps=$(awk -v g="$gbps" 'BEGIN { printf "%.0f", g * 1e9 }')
  burst=$(awk -v r="$rate_bps" -v m="$mtu" 'BEGIN { b = r / 8 * 1e-3; if (b < 4 * m) b = 4 * m; printf "%.0f", b }')
  local shape="tbf rate ${rate_bps}bit burst ${burst} latency 10ms"

  ip link add "$BRIDGE" type bridge
  ip addr add "$SUBNET.1/24" dev "$BRIDGE"
  ip link set "$BRIDGE" mtu "$mtu" up
  local cores; cores=$(nproc)
  : > "$STATE/hostfile"
  : > "$STATE/nodes"
  for i in $(seq 1 "$n"); do
    local ns=${PREFIX}-n$i host=$SUBNET.$((10 + i)) veth=${PREFIX}-v$i
    ip netns add "$ns"
    ip link add "$veth" mtu "$mtu" type veth peer name "${PREFIX}-p$i" mtu "$mtu"
    ip link set "${PREFIX}-p$i" netns "$ns"
    ip -n "$ns" link set "${PREFIX}-p$i" name eth0
    ip -n "$ns" addr add "$host/24" dev eth0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
    ip link set "$veth" master "$BRIDGE" up
    # Both directions of the node's link: what it sends, what it receives.
    ip netns exec "$ns" tc qdisc add dev eth0 root $shape
    tc qdisc add dev "$veth" root $shape
    echo "$host slots=1" >> "$STATE/hostfile"
    echo "$host $ns $(( (i - 1) % cores ))" >> "$STATE/nodes"
  done

  # OpenMPI's rsh launcher runs `agent HOST COMMAND...` where a remote
  # shell would run COMMAND: here, a shell inside HOST's namespace, pinned
  # to the node's core.
  cat > "$STATE/agent" <<EOF
#!/bin/sh
host=\$1; shift
line=\$(grep "^\$host " "$STATE/nodes") || { echo "cluster agent: unknown node \$host" >&2; exit 1; }
set -- \$line "\$@"
ns=\$2; core=\$3; shift 3
# A node of its own: its network namespace, its host name (a UTS
# namespace: daemons that share a host name race for the same session
# files) and its temporary directory.
mkdir -p "$STATE/\$ns"
exec ip netns exec "\$ns" unshare --uts env TMPDIR="$STATE/\$ns" taskset -c "\$core" \\
  /bin/sh -c "hostname \$ns && \$*"
EOF
  chmod +x "$STATE/agent"

  local args="--hostfile $STATE/hostfile --map-by node --bind-to none"
  args+=" --mca plm_rsh_agent $STATE/agent --mca plm_rsh_no_tree_spawn 1"
  args+=" --mca btl tcp,self --mca btl_tcp_if_include $SUBNET.0/24 --mca oob_tcp_if_include $SUBNET.0/24"
  [ "$(id -u)" = 0 ] && args+=" --allow-run-as-root"
  echo "$args" > "$STATE/mpirun_args"
  echo "cluster: $n node(s) ${PREFIX}-n1..${PREFIX}-n$n on $SUBNET.0/24, links of $gbps Gb/s each way (tbf, burst $burst B), MTU $mtu"
  echo "mpirun_args=$args"
}

case ${1:-} in
  up) shift; [ $# -ge 1 ] || usage; up "$@" ;;
  down) [ "$(id -u)" = 0 ] || die "needs root"; down; echo "cluster: down" ;;
  *) usage ;;
esac
