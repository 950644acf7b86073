"""Custom-op registration and dispatch, one module per op (namespace `gdn_packed`)."""
