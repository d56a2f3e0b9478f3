"""`make demo`: quark's sandbox (qvisor_demo) and TSoR's paths (tsor_demo), run as modules."""
