"""Compile-time compression policy: which cut edges are compressed, and how (AdaTopK, Eq. 7)."""
