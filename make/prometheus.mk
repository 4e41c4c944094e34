# promtool checks and unit-tests the alerting rules and the dashboard's PromQL; prometheus
# runs the live alert test. Both come from Debian's `prometheus` package (CI runs as root
# on Debian with only the package registries reachable).
.PHONY: prometheus-tools

tools: prometheus-tools

prometheus-tools:
	@if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then \
		if [ "$$(id -u)" -ne 0 ]; then \
			echo "promtool/prometheus missing: run 'make tools' as root or install Debian's prometheus package" >&2; \
			exit 1; \
		fi; \
		apt-get update && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus; \
	fi
	@promtool --version | head -n 1
