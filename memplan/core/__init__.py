"""Plain building blocks every stage uses: storages and their keys, byte units, host-memory marking, the tunables."""
