"""quark's version: the one place it is written. pyproject.toml's `version` matches it
(tests/unit/test_version.py); a node image's payload is stamped with its own (deploy/payload.py
--version rewrites this file in the payload), so a node tells which quark each sandbox was created
by (the `version` in its state) across an upgrade."""
VERSION = "0.1.0"
OCI_SPEC = "1.0.2"
