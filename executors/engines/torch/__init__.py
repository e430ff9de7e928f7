"""The torch engine: sub-DAGs under torch autograd, and its optimizer."""
