"""The streaming runtime on Ray: thin actor shells over the plain classes, and the launcher."""
