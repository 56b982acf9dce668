"""Generated code for the cpcache.v1 API (proto/cpcache/v1). Do not edit: run proto/generate.py."""
