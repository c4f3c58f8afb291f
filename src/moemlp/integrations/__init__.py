"""Bridges to other libraries, each imported on its own (``moemlp.integrations.transformers``) so
that moemlp itself never imports them."""
