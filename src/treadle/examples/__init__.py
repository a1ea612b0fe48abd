"""Example agent harnesses: programs that know nothing of treadle but the OpenAI API
(docs/gateway.md). Nothing in treadle imports them."""
