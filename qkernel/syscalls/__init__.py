"""One module per syscall family; each exposes the handlers the table (qkernel/table.py) names."""
