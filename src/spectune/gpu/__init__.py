"""What a user's GPU will do: a card model fitted on published llama.cpp figures (published.yaml), its error, and
the predictions spectune quotes through it (`spectune predict`, the bench's and the acceptance meter's GPU columns)."""
