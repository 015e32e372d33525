"""Model builders for tfpipe examples and launch scripts."""
