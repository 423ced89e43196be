"""Deployable services: thin gRPC/HTTP servers over the tandem library, one folder per stage."""
