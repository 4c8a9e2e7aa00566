"""Process-wide speed settings (threads, oneDNN), in one place. Filled in below."""


def configure_runtime(num_contexts=1):
    """Apply the process-wide settings for training on ``num_contexts`` devices."""
    return {}
