"""What ships beside the code agrees with it: the package metadata, the
generated gRPC code, the generated and linked documentation pages."""
