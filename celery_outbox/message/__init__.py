"""What a message is: envelope, routing, checks, dead-letter row, and the result its caller is told.

Pure values and functions: no transaction.
"""
