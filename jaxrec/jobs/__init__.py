"""Runnable jobs behind console entry points (``jaxrec-train-dlrm``)."""
