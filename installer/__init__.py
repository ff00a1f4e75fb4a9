"""Installation: the demo model today; profiling, planning, staging and bundles next."""

from installer.demo_model import prepare, verify

__all__ = ["prepare", "verify"]
