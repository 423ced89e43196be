"""Tandem: disaggregated LLM serving on typed gRPC contracts."""
