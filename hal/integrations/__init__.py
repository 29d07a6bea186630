"""Adapters from the layouts of the engines people already run to spec-hal's ops. Thin:
each converts a layout and calls the selected backend's op; none imports its engine."""
