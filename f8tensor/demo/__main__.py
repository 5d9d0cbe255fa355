"""``python -m f8tensor.demo``."""

from f8tensor.demo import main

main()
