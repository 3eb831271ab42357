"""`python -m miniserve ...` and the `miniserve` command: arguments, generate, chat, bench,
serve, and starting the web app."""
