"""``python -m flowrl`` (also what ``accelerate launch -m flowrl train RECIPE`` runs)."""

from .cli import main

main()
