"""Tables and plots for humans: the eval report (markdown, JSON summary, PNG chart) and console tables."""
