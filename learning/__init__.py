"""The learning worker: Celery tasks that retrain the length predictor and the batch-time
estimator off the request path (``predictor.learning`` does the work), and its commands
(``cohort worker learning``, ``cohort worker beat``). Kept out of ``workers``, which is the LLM
instance."""
