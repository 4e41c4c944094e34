# The lab hosts of the multi-host partition tests (tests/netlab): `ip` (iproute2) makes the
# network namespaces, veth pairs and the bridge; `nft` (nftables) drops one direction of a
# link. Both from Debian's packages (CI runs as root on Debian with only the package
# registries reachable); without root the tests that need them skip with one line.
.PHONY: netlab-tools

tools: netlab-tools

netlab-tools:
	@if ! command -v ip >/dev/null 2>&1 || ! command -v nft >/dev/null 2>&1; then \
		if [ "$$(id -u)" -ne 0 ]; then \
			echo "ip/nft missing: the partition tests will skip (install iproute2 and nftables as root)" >&2; \
		else \
			apt-get update && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends iproute2 nftables; \
		fi; \
	fi
	@ip -V; nft --version 2>/dev/null || true
