"""Layer 3: Schedule -> Schedule transforms (repair, paging, polish, pin search, coarsening, ordering),
each result judged by the simulator. Imports only the layers below."""
