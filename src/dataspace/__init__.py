"""dataspace: a Python dataspace broker and toolkit.

Programs assert structured Preserves values into a dataspace, observe them with patterns,
send messages, record them into durable streams and run exactly-once pipelines over them.
"""

__version__ = "0.1.0"
