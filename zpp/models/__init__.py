"""Model families split into pipeline stages."""
