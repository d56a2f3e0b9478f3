"""Test and demo machinery: busybox bundles and the TSoR testbed (pods and nodes on one machine)."""
