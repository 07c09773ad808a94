"""Suite-wide plugins: `require_extras` (CKPT_REQUIRE_EXTRAS=1 turns a skip for a missing optional framework into a
failure)."""

pytest_plugins = ["require_extras"]
