"""Tools for Tandem's developers (documentation generators); nothing here runs in a service."""
