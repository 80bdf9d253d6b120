"""Tools on top of the library (never imported by it): the `dos` command, `dos bench`, benchmark models."""
