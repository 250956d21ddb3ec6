"""Tools on top of the library: the command line, plots and reports, and the demo."""
