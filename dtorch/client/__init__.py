"""The client role: symbols, the record buffer, and the receiver of values and errors."""
