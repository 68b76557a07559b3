"""Delivery to consumers: subscriptions and their dispatch, consumers, Key_Shared, redelivery,
cursors, and dead-letter topics."""
