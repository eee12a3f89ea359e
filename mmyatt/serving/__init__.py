"""Judge serving: GenRM judges behind the OpenAI chat-completions HTTP API.

``server`` (FastAPI and uvicorn: ``mmyatt serve-genrm``) answers with a judge model of
:mod:`mmyatt.models.judge`, its requests gathered by ``batcher``, behind ``guard`` (API
key, body limit, OpenAI-shaped errors); ``api`` holds the pydantic models of every
route; ``client`` (httpx and tenacity) is what rewards call, against this server or
``vllm serve`` alike; ``pool`` starts and restarts the servers of a run.
"""

API_KEY_ENV = "MMYATT_GENRM_API_KEY"  # how a judge pool hands the key to its servers
