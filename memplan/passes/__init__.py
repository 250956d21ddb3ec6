"""Graph passes over a captured joint graph: each rewrites or annotates the graph without changing its values."""
